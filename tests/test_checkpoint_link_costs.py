"""Sixth audit: a shared checkpoint whose workspace is 50,000 long-named symlinks (0.9 MB of
gzip) passed the check in 16.6 s, was checked again before the machine came up, and then
unpacked in the machine for more than 6 minutes; 500,000 of them were refused only after
211 s and 945 MB. Work is counted here (headers read, lines run, checks made), never timed.
"""

from __future__ import annotations

import io
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any

import pytest

from smolbench.gate import archive


def _links(n: int, name: int, target: int, extra: tuple[tarfile.TarInfo, ...] = ()) -> bytes:
    """The audit's workspace (``/work/audit/pkg/t4/many.py``): ``n`` links ``dNNNNNNN/aaa…``
    (a last part of ``name`` bytes) to ``./b/b/…`` (``target`` parts), GNU long names."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info in extra:
            tar.addfile(info)
        for i in range(n):
            info = tarfile.TarInfo(f"d{i:07d}/" + "a" * name)
            info.type, info.linkname = tarfile.SYMTYPE, "." + "/b" * target
            tar.addfile(info)
    return out.getvalue()


@pytest.fixture
def headers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many headers the check reads (one count per ``next``)."""
    read = [0]
    real = archive._CheckedTar.next

    def counted(self: tarfile.TarFile) -> Any:
        read[0] += 1
        return real(self)

    monkeypatch.setattr(archive._CheckedTar, "next", counted)
    yield read


def _lines_in_resolve(blob: bytes) -> int:
    """Lines of ``archive._resolve`` run checking ``blob`` (a Python step each: what took seconds)."""
    lines = [0]
    code = archive._resolve.__code__

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        if frame.f_code is not code:
            return None
        if event == "line":
            lines[0] += 1
        return trace

    sys.settrace(trace)
    try:
        archive.check_workspace(blob, "checkpoint links")
    finally:
        sys.settrace(None)
    return lines[0]


def test_names_no_file_system_makes_are_refused_at_their_first_header(headers: list[int]) -> None:
    """The audit's 291-byte last parts: the machine can't make such a link, and tarfile then
    looked for its target among every member, for each link (minutes in the machine)."""
    blob = _links(2000, 291, 149)
    with pytest.raises(archive.UnsafeCheckpoint, match="a part longer than 255 bytes"):
        archive.check_workspace(blob, "checkpoint links")
    assert headers[0] <= 2, headers[0]
    archive.check_workspace(_links(3, 255, 3), "checkpoint fine")  # as long as a file system allows


def test_following_links_costs_a_few_steps_a_link_not_one_a_part() -> None:
    """Each link's target was walked part by part in Python, twice (its own check, then its
    name's, which followed it again): ~600 steps for each of the audit's links."""
    n = 200
    lines = _lines_in_resolve(_links(n, 200, 300))
    assert lines < 40 * n, f"{lines} lines for {n} links"


def test_an_archive_over_a_budget_is_refused_where_it_goes_over_not_after_reading_it_all(
        headers: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """500,000 links were all read (945 MB of headers kept) before the walk's budget refused them."""
    n = 400
    monkeypatch.setattr(archive, "WALK_LIMIT", 30_000)  # ~100 of these links' walks
    with pytest.raises(archive.UnsafeCheckpoint, match="take more than 30,000 steps"):
        archive.check_workspace(_links(n, 200, 300), "checkpoint links")
    assert headers[0] < n // 2, headers[0]
    headers[0] = 0
    monkeypatch.setattr(archive, "LINK_LIMIT", 50)  # links on their own: each one costs the machine a lookup
    with pytest.raises(archive.UnsafeCheckpoint, match="more than 50 links"):
        archive.check_workspace(_links(n, 10, 3), "checkpoint links")
    assert headers[0] <= 52, headers[0]


def test_tarfile_keeps_no_header_while_the_check_reads() -> None:
    """tarfile keeps every header it reads (the audit's 945 MB): the check keeps names only."""
    with archive.open_tar(fileobj=io.BytesIO(_links(300, 10, 3)), mode="r:") as tar:
        archive.check_members(tar, "checkpoint links")
        assert len(tar.members) <= 1


def _venv_like(files: int) -> bytes:
    """A workspace shaped like a venv: folders of a few dozen files, ~8 parts deep, a few links."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for link, target in (("venv/bin/python", "python3.11"), ("venv/bin/python3", "python3.11"),
                             ("venv/lib64", "lib"), ("data", "venv/lib/python3.11/site-packages/pkg0/data")):
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        for i in range(files):
            info = tarfile.TarInfo(f"venv/lib/python3.11/site-packages/pkg{i // 40}/sub/module_{i}.py")
            info.size = 10
            tar.addfile(info, io.BytesIO(b"x" * 10))
        info = tarfile.TarInfo("data/through-a-link.csv")  # reached through a link that stays inside
        tar.addfile(info)
    return out.getvalue()


def test_an_honest_many_file_workspace_passes_with_a_few_steps_a_file(headers: list[int]) -> None:
    files = 20_000
    blob = _venv_like(files)
    with archive.open_tar(fileobj=io.BytesIO(blob), mode="r:") as tar:
        assert archive.check_members(tar, "checkpoint venv") == files * archive.PAGE
    assert headers[0] == files + 5 + 2  # each header read once (tarfile reads the first on opening; the end)
    assert _lines_in_resolve(_venv_like(2000)) < 40 * 2000  # (each name: its first parts, up to the links' folders)


def _links_tarfile_cant_make(n: int) -> bytes:
    """``n`` links each at the name of a folder already unpacked (``dI/x`` first, then ``dI ->
    t``): the machine's tarfile can't make them, and copies their target instead."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        tar.addfile(_info("t", tarfile.DIRTYPE))
        for i in range(n):
            tar.addfile(_info(f"d{i}", tarfile.DIRTYPE))
            tar.addfile(_info(f"d{i}/x", tarfile.REGTYPE))
            tar.addfile(_info(f"d{i}", tarfile.SYMTYPE, "t"))
    return out.getvalue()


def _info(name: str, kind: bytes, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    if kind == tarfile.DIRTYPE:
        info.mode = 0o755
    return info


def test_the_machine_unpacks_links_it_cant_make_in_steps_linear_in_the_members(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tarfile looked each such link's target up among every member (a path normalized per
    member, per link): 5,000 of them took 76 s to unpack, and the host's check lets them by
    (each stays inside). Counted: the names normalized while unpacking."""
    import posixpath

    from smolbench.guest import nsstream
    from smolbench.guest.saveload import SaveLoad

    n = 300
    blob = _links_tarfile_cant_make(n)
    archive.check_workspace(blob, "checkpoint links")  # let by: every link stays inside
    stage, work = tmp_path / "stage", tmp_path / "work"
    stage.mkdir()
    work.mkdir()
    (stage / "workspace.tar").write_bytes(blob)
    with open(stage / "namespace.pkl", "wb") as fh:
        nsstream.dump(fh, {"modules": {}, "seed": None, "name": "r1"}, [("v", 1)])
    machine = SimpleNamespace(workdir=str(work), ns={}, _reward_restored=lambda: None)
    normalized = [0]
    real = posixpath.normpath

    def counted(path: Any) -> Any:
        normalized[0] += 1
        return real(path)

    monkeypatch.setattr(posixpath, "normpath", counted)
    done = SaveLoad.load(machine, str(stage))  # type: ignore[arg-type]
    monkeypatch.setattr(posixpath, "normpath", real)
    assert done["status"] == "ok" and machine.ns["v"] == 1
    assert (work / "d7" / "x").is_file()  # the folder stays; its link could not be made
    assert normalized[0] < 20 * 3 * n, f"{normalized[0]} names normalized for {3 * n + 1} members"
