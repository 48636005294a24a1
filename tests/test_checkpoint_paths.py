"""A ledger row never steers a read or a delete, and a restore unpacks nothing outside the
machine (issue 25 items 4 and 7), through a real kernel (root, and smolci in CI's second pass).

The attack: a shared or copied folder carries someone else's ledger, whose checkpoint rows
name any path. Each row below points outside this folder's checkpoint folder (a file in a
private 0700 folder, /etc/hostname, a folder, a link to the private file, ``..``, a hard
link, a linked checkpoint folder). Restoring one is refused in one line that never advises
deleting that path; removing one forgets the row and leaves the path alone. The same rows
through the Jupyter server's REST delete, which hands the delete to the live kernel that
owns the ledger (``%smol checkpoint rm NAME``), delete nothing outside either. Against the
code before the rule (``ckptpaths.TEST_WEAKEN = {"name"}`` in the kernel: the row's path as
given) the private file is restored from and then deleted.

Restores: with ``TMPDIR`` pointed at a folder of the test, nothing appears there outside
the machines' own run folders while a checkpoint is restored, and nothing is left after;
a gzip bomb beyond a small ``checkpoint-limit`` is refused in one line, and with the
header check switched off the streaming count still stops it at the limit.
"""

from __future__ import annotations

import gzip
import io
import os
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nbhelpers import NotebookSession, ok, one_line, stream_text

from smolbench.ledger import Ledger

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")



@pytest.fixture
def private() -> Iterator[Path]:
    """A folder only its owner may enter (root's, or smolci's in the second pass), outside the notebook's."""
    path = Path(tempfile.mkdtemp(prefix="smolbench-private-"))
    path.chmod(0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def plant_rows(folder: Path, private: Path, good: Path) -> dict[str, Path]:
    """Rows that name paths outside this folder's checkpoint folder; what each must leave alone."""
    ckdir = folder / ".smolbench" / "checkpoints"
    secret = private / "secret.smolcheckpoint"
    shutil.copyfile(good, secret)  # a real checkpoint: restoring from it would read it
    (ckdir / "dir.smolcheckpoint").mkdir()
    (ckdir / "link.smolcheckpoint").symlink_to(secret)
    os.link(secret, ckdir / "hard.smolcheckpoint")
    other = folder / "elsewhere"
    other.mkdir()
    (other / "checkpoints").symlink_to(private)  # a linked checkpoint folder
    rows = {
        "outside": str(secret),
        "hostname": "/etc/hostname",
        "folder": str(private),
        "dirfile": "checkpoints/dir.smolcheckpoint",
        "link": "checkpoints/link.smolcheckpoint",
        "dotdot": f"checkpoints/../../../{private.name}/secret.smolcheckpoint",
        "relout": os.path.relpath(secret, folder / ".smolbench"),
        "hard": "checkpoints/hard.smolcheckpoint",
    }
    led = Ledger(folder / ".smolbench" / "ledger.db")
    for name, path in rows.items():
        led.add_checkpoint(name, "someone-else", "root", path, "sandbox", 1, 1, [])
    led.close()
    return {"secret": secret, "hostname": Path("/etc/hostname"), "private": private}


def snapshot(paths: dict[str, Path]) -> dict[str, Any]:
    return {k: (p.read_bytes() if p.is_file() else sorted(os.listdir(p))) for k, p in paths.items()}


@pytest.fixture
def nb(open_tmp: Path) -> Iterator[NotebookSession]:
    with NotebookSession(open_tmp, timeout=300, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        ok(s.run("%smol up --backend sandbox"))
        ok(s.run("%%smol\nx = 'secret state'"))
        ok(s.run("%smol checkpoint save good"))
        ok(s.run("%%smol\nx = 'mine'"))
        yield s


def test_a_ledger_row_never_steers_a_restore_or_a_delete(nb: NotebookSession, open_tmp: Path, private: Path) -> None:
    good = open_tmp / ".smolbench" / "checkpoints" / "good.smolcheckpoint"
    keep = plant_rows(open_tmp, private, good)
    before = snapshot(keep)
    for name in ("outside", "hostname", "folder", "dirfile", "link", "dotdot", "relout", "hard"):
        line = one_line(nb.run(f"%smol checkpoint restore {name}"))
        assert f"checkpoint '{name}' can't be used" in line, line
        assert f"`%smol checkpoint rm {name}` forgets the row and leaves that path alone" in line, line
        assert "delete it" not in line, line
    assert "is a hard link (2 names" in one_line(nb.run("%smol checkpoint restore hard"))
    assert "is a link: refused" in one_line(nb.run("%smol checkpoint restore link"))
    # no machine came from any of them, and the machine up still has its own state
    assert stream_text(ok(nb.run("%%smol\nprint(x)"))) == "mine\n"
    assert "r1-" not in stream_text(ok(nb.run("import smolbench\nprint(list(smolbench._magics.workbench.machines))")))

    for name in ("outside", "hostname", "folder", "dirfile", "link", "dotdot", "relout"):
        said = stream_text(ok(nb.run(f"%smol checkpoint rm {name}")))
        assert said.startswith(f"smolbench: removed checkpoint {name}; its row named "), said
        assert said.rstrip().endswith("left alone"), said
    # a hard link: only this folder's name goes; the other name keeps its content
    assert stream_text(ok(nb.run("%smol checkpoint rm hard"))) == "smolbench: removed checkpoint hard\n"
    assert snapshot(keep) == before
    assert keep["secret"].stat().st_nlink == 1
    rows = Ledger(open_tmp / ".smolbench" / "ledger.db")
    assert [r["name"] for r in rows.checkpoint_rows()] == ["good"]
    assert rows.checkpoint("good")["path"] == "checkpoints/good.smolcheckpoint"  # relative to the ledger's folder
    rows.close()
    # the folder's own checkpoint still works
    ok(nb.run("%smol checkpoint restore good"))
    assert stream_text(ok(nb.run("%%smol\nprint(x)"))) == "secret state\n"


def test_a_linked_checkpoint_folder_is_never_used(nb: NotebookSession, open_tmp: Path, private: Path) -> None:
    """The whole ``.smolbench/checkpoints`` folder swapped for a link to a private one."""
    ckdir = open_tmp / ".smolbench" / "checkpoints"
    shutil.copyfile(ckdir / "good.smolcheckpoint", private / "good.smolcheckpoint")
    shutil.rmtree(ckdir)
    ckdir.symlink_to(private)
    line = one_line(nb.run("%smol checkpoint restore good"))
    assert "is a link or not a folder" in line and "delete it" not in line, line
    said = stream_text(ok(nb.run("%smol checkpoint rm good")))
    assert "left alone" in said, said
    assert (private / "good.smolcheckpoint").exists()
    line = one_line(nb.run("%smol checkpoint save again"))
    assert "can't create the checkpoint folder" in line and "is a link or not a folder" in line, line
    assert sorted(os.listdir(private)) == ["good.smolcheckpoint"]


def test_the_rows_restore_and_delete_the_private_file_when_the_rule_is_weakened(
        nb: NotebookSession, open_tmp: Path, private: Path) -> None:
    """The contrast: the same probe against the path used as given (the code before the rule)."""
    keep = plant_rows(open_tmp, private, open_tmp / ".smolbench" / "checkpoints" / "good.smolcheckpoint")
    ok(nb.run("from smolbench.gate import ckptpaths\nckptpaths.TEST_WEAKEN.update({'name', 'hardlink'})"))
    ok(nb.run("%smol checkpoint restore outside"))  # read from the private folder
    assert stream_text(ok(nb.run("%%smol\nprint(x)"))) == "secret state\n"
    ok(nb.run("%smol checkpoint rm outside"))
    assert not keep["secret"].exists()  # and deleted there
    ok(nb.run("ckptpaths.TEST_WEAKEN.clear()"))


# -- restores unpack nothing outside the machine ---------------------------------------------


class Watch(threading.Thread):
    """Polls a folder for files outside machines' run folders (a folder holding an ``owner``
    record is one, and stays one while it is deleted: its owner may go before its agent.log)
    while a restore runs; the most bytes seen there at once, and their names."""

    def __init__(self, folder: Path) -> None:
        super().__init__(daemon=True)
        self.folder, self.most, self.seen = folder, 0, set[str]()
        self.runs: set[str] = set()
        self.stop = threading.Event()

    def look(self) -> int:
        total = 0
        for dirpath, dirnames, filenames in os.walk(self.folder):
            if Path(dirpath).parent == self.folder and ("owner" in filenames or dirpath in self.runs):
                self.runs.add(dirpath)
                dirnames[:] = []  # a machine's own run folder
                continue
            for f in filenames:
                p = Path(dirpath, f)
                try:
                    total += p.stat().st_size
                except OSError:
                    continue
                self.seen.add(str(p.relative_to(self.folder)))
        return total

    def run(self) -> None:
        while not self.stop.is_set():
            self.most = max(self.most, self.look())
            time.sleep(0.002)

    def __enter__(self) -> Watch:
        self.look()  # the run folders there already, before a restore deletes one
        self.most, self.seen = 0, set()
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.join()


def bomb(path: Path, claimed: int, like: Path) -> None:
    """A checkpoint whose workspace archive is ``claimed`` bytes of zeros (a few KB gzipped),
    with the namespace of the checkpoint ``like``."""
    with tarfile.open(like, "r:gz") as tar:
        member = tar.extractfile("namespace.pkl")
        assert member is not None
        namespace = member.read()
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w:") as tar:
        info = tarfile.TarInfo("zeros.bin")
        info.size = claimed - 3 * 512 - 10240
        tar.addfile(info, io.BytesIO(b"\0" * info.size))
    blob = inner.getvalue()
    with gzip.open(path, "wb", compresslevel=9) as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        for name, data in (("namespace.pkl", namespace), ("workspace.tar", blob)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_restore_unpacks_nothing_into_tmpdir_and_a_bomb_stops_at_the_limit(
        open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmpdir = open_tmp / "tmp"
    tmpdir.mkdir()
    tmpdir.chmod(0o777)
    work = open_tmp / "work"
    work.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    with NotebookSession(work, timeout=300, allow_errors=True) as s:
        ok(s.run("%load_ext smolbench"))
        ok(s.run("%smol up --backend sandbox"))
        ok(s.run("%%smol\nopen('big.bin', 'wb').write(b'\\0' * (48 << 20))\nx = 7"))
        ok(s.run("%smol checkpoint save big"))
        assert (work / ".smolbench" / "checkpoints" / "big.smolcheckpoint").stat().st_size < (2 << 20)  # high ratio
        with Watch(tmpdir) as watch:
            ok(s.run("%smol checkpoint restore big"))
        assert watch.most == 0, sorted(watch.seen)
        assert stream_text(ok(s.run("%%smol\nimport os\nprint(x, os.path.getsize('big.bin'))"))) == f"7 {48 << 20}\n"

        ckdir = work / ".smolbench" / "checkpoints"
        bomb(ckdir / "bomb.smolcheckpoint", 64 << 20, ckdir / "big.smolcheckpoint")
        assert (ckdir / "bomb.smolcheckpoint").stat().st_size < (1 << 20)
        ok(s.run("%smol config checkpoint-limit 20M"))
        with Watch(tmpdir) as watch:
            line = one_line(s.run("%smol checkpoint restore bomb"))
        assert "over the checkpoint limit of 20 MB" in line, line
        assert watch.most == 0, sorted(watch.seen)
        # the header check off: the bytes are counted as they stream, and stop at the limit
        ok(s.run("from smolbench.gate import archive\narchive.TEST_WEAKEN.add('size')"))
        with Watch(tmpdir) as watch:
            line = one_line(s.run("%smol checkpoint restore bomb"))
        assert "unpacks to more than the checkpoint limit of 20 MB: stopped there" in line, line
        assert watch.most == 0, sorted(watch.seen)
        live = stream_text(ok(s.run("import smolbench\nprint(sorted(smolbench._magics.workbench.machines))")))
        assert live == "['r1-big', 'root']\n", live  # the refused restores left no machine
        # both checks off: the same bomb gets in (the probe is real)
        ok(s.run("archive.TEST_WEAKEN.add('stream')"))
        ok(s.run("%smol checkpoint restore bomb"))
        ok(s.run("archive.TEST_WEAKEN.clear()"))
        got = stream_text(ok(s.run("%%smol\nimport os\nprint(os.path.getsize('zeros.bin'))")))
        assert int(got) > 60 << 20, got  # the zeros were all written
        ok(s.run("%smol down"))
    assert os.listdir(tmpdir) == []


# -- the server's delete, handed to the live kernel that owns the ledger -----------------------

from pytest_jupyter.jupyter_server import *  # noqa: E402, F403  (fixtures: a real Jupyter server)


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    return {"ServerApp": {"jpserver_extensions": {"smolbench.server": True}}}


def _execute(km: Any, loop: Any, code: str) -> str:
    client = km.client()
    client.start_channels()
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["header"]["msg_type"] in ("stream", "error"):
            out.append(msg["content"].get("text") or "\n".join(msg["content"].get("traceback", [])))

    try:
        reply = loop.run_until_complete(client.execute_interactive(code, timeout=240, output_hook=hook))
    finally:
        client.stop_channels()
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


def test_the_rest_delete_through_a_live_kernel_deletes_nothing_outside(
        jp_serverapp: Any, jp_fetch: Any, jp_asyncio_loop: Any, jp_root_dir: Path, private: Path) -> None:
    import asyncio
    import json

    from tornado.httpclient import HTTPClientError

    asyncio.set_event_loop(jp_asyncio_loop)
    mkm = jp_serverapp.kernel_manager
    kid = jp_asyncio_loop.run_until_complete(mkm.start_kernel(kernel_name="python3", path=""))
    try:
        km = mkm.get_kernel(kid)
        _execute(km, jp_asyncio_loop, "%load_ext smolbench\n%smol up --backend sandbox")
        _execute(km, jp_asyncio_loop, "%%smol\nx = 1")
        _execute(km, jp_asyncio_loop, "%smol checkpoint save good")
        good = jp_root_dir / ".smolbench" / "checkpoints" / "good.smolcheckpoint"
        keep = plant_rows(jp_root_dir, private, good)
        before = snapshot(keep)

        def delete(name: str) -> tuple[int, dict[str, Any]]:
            try:
                resp = jp_asyncio_loop.run_until_complete(
                    jp_fetch("smolbench", "api", "checkpoints", name, method="DELETE", params={"path": ""}))
            except HTTPClientError as exc:
                assert exc.response is not None
                return exc.code, json.loads(exc.response.body or b"{}")
            return resp.code, json.loads(resp.body or b"{}")

        for name in ("outside", "hostname", "folder", "dirfile", "link", "dotdot", "relout", "hard"):
            code, body = delete(name)
            assert code == 200 and body["action"] == "asked-kernel", body
            assert body["message"].startswith(f"asked kernel {kid[:8]} to remove checkpoint {name}: "), body
            if name != "hard":
                assert "left alone" in body["message"], body
        assert snapshot(keep) == before
        code, body = delete("good")
        assert code == 200 and body["message"].endswith("smolbench: removed checkpoint good"), body
        assert not good.exists()
        _execute(km, jp_asyncio_loop, "%smol down")
    finally:
        jp_asyncio_loop.run_until_complete(mkm.shutdown_kernel(kid))


@pytest.mark.parametrize("linked", [".smolbench", ".smolbench/ledger.db", ".smolbench/ledger.db-wal"])
def test_a_copied_folder_whose_ledger_links_elsewhere_is_refused(tmp_path: Path, linked: str) -> None:
    """Third audit: ``.smolbench/ledger.db`` linking to another project's ledger (or to where
    none is yet) had this kernel make or write a database there."""
    from smolbench.errors import SmolbenchError
    from smolbench.ledger import Ledger

    folder, outside = tmp_path / "copied", tmp_path / "outside"
    outside.mkdir()
    (folder / ".smolbench").mkdir(parents=True)
    if linked == ".smolbench":
        (folder / ".smolbench").rmdir()
    (folder / linked).symlink_to(outside / "victim" if linked != ".smolbench" else outside)
    with pytest.raises(SmolbenchError, match=r"has a symbolic link at .* a ledger is opened only as a plain file"):
        Ledger(folder / ".smolbench" / "ledger.db")
    assert list(outside.iterdir()) == []  # nothing made or written where the link points
    # a plain folder is used as ever
    Ledger(tmp_path / "plain" / ".smolbench" / "ledger.db").close()
