"""The packages cache's trust and use: a machine mounts the folder that was checked, the folders
above the cache are checked too, and a running machine's entry is kept from prune."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from test_packages import PKG, cache, needs_bwrap  # noqa: F401 - the fixture

from smolbench import packages
from smolbench.backends.base import CellRequest
from smolbench.errors import SmolbenchError
from smolbench.spec import MachineSpec


def _plant(entry: Path) -> None:
    """What a racing swap puts in the checked entry's place: a tree that passes every check."""
    module = entry / "lib" / "tomli_w" / "__init__.py"
    module.parent.mkdir(parents=True)
    module.write_text("PLANTED = True\n")
    (entry / packages.META).write_text("{}\n")
    for path in (entry, entry / "lib", module.parent):
        path.chmod(0o755)
    module.chmod(0o644)


@needs_bwrap
def test_a_sandbox_mounts_the_entry_that_was_checked_though_it_was_swapped_before_the_mount(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The entry was checked by its path, then bound by its path: a swap in between (a folder renamed
    away and another put in its place) was what the machine imported. Now bwrap binds the folder checked."""
    from smolbench.backends import sandbox
    from smolbench.backends.sandbox import SandboxBackend

    real = sandbox.plan

    def swapped_first(*args: object, **kwargs: object) -> object:  # between the check and the mount
        [entry] = [p for p in (cache / "packages").iterdir() if not p.name.startswith(".")]
        os.rename(entry, tmp_path / "moved-away")
        _plant(entry)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sandbox, "plan", swapped_first)

    async def main() -> str:
        (tmp_path / "run").mkdir()
        be = SandboxBackend(runtime_dir=str(tmp_path / "run"))
        try:
            root = await be.create(MachineSpec(packages=(PKG,)), "root")
            res = await be.exec_cell(root, CellRequest("import tomli_w\nhasattr(tomli_w, 'PLANTED'), tomli_w.dumps({'a': 1})"),
                                     lambda ev: None)
            assert res.status == "ok", res.error
            return str((res.result or {}).get("text/plain"))
        finally:
            await be.close()

    assert asyncio.run(main()) == "(False, 'a = 1\\n')"


def test_a_folder_above_the_cache_others_can_write_in_is_refused_unless_sticky(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the packages folder itself was checked: another user able to write in a folder above it
    could rename it and put a cache of their own in its place. Now every folder above is checked, as
    ssh does (up to the home, or /): the user's own or root's, and writable by others only if sticky."""
    shared = tmp_path / "shared"
    root = shared / "cache" / "packages"
    root.mkdir(parents=True)
    for path in (shared / "cache", root):
        path.chmod(0o755)
    monkeypatch.setenv("SMOLBENCH_CACHE", str(shared / "cache"))
    shared.chmod(0o777)

    def refused() -> str:
        with pytest.raises(SmolbenchError) as err:
            packages.ensure((PKG,), packages.host_python())
        assert "\n" not in str(err.value), str(err.value)
        return str(err.value)

    assert refused() == (f"refusing the packages cache {root}: the folder {shared} above it: it is writable by group "
                         "and others (mode 0777 and not sticky), so another user could rename it and put their "
                         f"own in its place; chmod go-w {shared} (or chmod +t {shared}), or set $SMOLBENCH_CACHE to a "
                         "folder of your own")
    with pytest.raises(SmolbenchError, match="above it: it is writable by group and others"):
        packages.entries()  # `smolbench packages list` and prune say so too
    shared.chmod(0o1777)  # sticky, like /tmp: others can't rename what is not theirs in it
    os.close(packages.open_root(root))
    link = tmp_path / "link"  # a link the user made to the cache: what it points at is checked
    link.symlink_to(shared / "cache")
    monkeypatch.setenv("SMOLBENCH_CACHE", str(link))
    os.close(packages.open_root(link / "packages"))
    shared.chmod(0o775)
    assert "above it: it is writable by group (mode 0775 and not sticky)" in refused()
    if os.getuid() == 0:  # a folder above of another user: they can rename in it whatever its mode
        shared.chmod(0o755)
        os.chown(shared, 65534, 65534)
        assert f"the folder {shared} above it: it belongs to uid 65534, not you (uid 0) or root" in refused()
        os.chown(shared, 0, 0)
    shared.chmod(0o755)
    os.close(packages.open_root(root))


def test_prune_keeps_an_entry_a_running_machine_holds_and_says_so(
        cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    """`smolbench packages prune --days 0` removed the entry of a machine still up: its next import
    failed. A machine now holds a shared lock on its entry while it runs; prune skips it, and says so."""
    from smolbench import cli
    from smolbench.backends.process import ProcessBackend

    async def up_then_down(during: object) -> None:
        be = ProcessBackend()
        try:
            root = await be.create(MachineSpec(packages=(PKG,)), "root")
            assert callable(during)
            during()
            res = await be.exec_cell(root, CellRequest("import tomli_w\ntomli_w.dumps({'a': 1})"), lambda ev: None)
            assert res.status == "ok", res.error  # its packages are still there
        finally:
            await be.close()

    def prune_while_up() -> None:
        [entry] = [p for p in (cache / "packages").iterdir() if not p.name.startswith(".")]
        past = time.time() - 40 * 86400
        os.utime(entry / packages.META, (past, past))
        assert cli.main(["packages", "prune", "--days", "0"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == f"kept {entry}: a running machine uses it (`%smol down` it, then prune again)", out
        assert out[1].startswith("0 folders, 0 MB freed in ") and (entry / "lib" / "tomli_w").is_dir()

    asyncio.run(up_then_down(prune_while_up))
    removed, in_use = packages.prune(0)  # down: the entry is free
    assert in_use == [] and [p.name for p, _ in removed] != [] and not any(
        p for p in (cache / "packages").iterdir() if not p.name.startswith("."))
    held = packages.ensure((PKG,), packages.host_python())  # held till closed (or dropped)
    assert packages.prune(0) == ([], [held.lib.parent])
    held.close()
    assert [p for p, _ in packages.prune(0)[0]] == [held.lib.parent]


def test_a_smolfile_edited_while_up_is_said_once_at_the_next_cell_or_fork(tmp_path: Path) -> None:
    """A Smolfile edited after `%smol up` (a package added) went unnoticed: the machines kept the
    old spec, silently. Now the next cell or fork says so once, in one line, with how to apply it;
    an edit that leaves the spec as it was (a comment) says nothing."""
    from smolbench import Session

    smolfile = tmp_path / "Smolfile"
    smolfile.write_text("memory = 512\n")
    said: list[str] = []
    with Session(smolfile, backend="process", ledger=tmp_path / "ledger.db", on_notice=said.append) as s:
        s.run("1")
        smolfile.write_text("memory = 512\n# only a comment\n")
        s.run("1")
        assert [ln for ln in said if "Smolfile" in ln] == []
        smolfile.write_text(f'memory = 512\npackages = ["{PKG}"]\n')
        s.run("1")
        s.fork(2, "reward = 1.0")
        smolfile.write_text("memory = 1024\n")
        s.run("1")
        news = [ln for ln in said if "Smolfile" in ln]
        assert news == [f"smolbench: the Smolfile {smolfile} changed since `Session.up()` (packages); machines keep "
                        "the spec they were made with: `Session.down()` then `Session.up()` to apply it"], said
        s.down()
        s.up()  # the up reads it anew: nothing to say
        s.run("1")
        smolfile.write_text("memory = [\n")
        s.fork(2, "reward = 1.0")  # a fork says it too, and an edit that doesn't parse is said as such
        news = [ln for ln in said if "Smolfile" in ln]
        assert len(news) == 2 and news[1].startswith(f"smolbench: the Smolfile {smolfile} changed since `Session.up()` "
                                                     "and doesn't parse now ("), news
        assert news[1].endswith("fix it, then `Session.down()` then `Session.up()` to apply it"), news


def test_prune_never_opens_a_lock_through_a_link_planted_at_its_name(cache: Path, tmp_path: Path) -> None:  # noqa: F811
    """Attack: a link planted at a key's lock name in the cache (``.KEY.lock`` -> any path) had
    prune open it to append, creating the file it names (prune may run as root). The lock is opened
    without following a link and only a plain file is used; the folder beside it is left."""
    root = cache / "packages"
    (root / ".abc.tmp-1").mkdir(parents=True)  # what a killed install left: prune takes it under its lock
    target = tmp_path / "made-by-prune"
    (root / ".abc.lock").symlink_to(target)
    os.mkfifo(root / ".def.lock")
    (root / ".def.tmp-1").mkdir()
    assert packages.prune(0) == ([], [])
    assert not target.exists() and (root / ".abc.tmp-1").is_dir() and (root / ".def.tmp-1").is_dir()
