"""A Smolfile volume never gives a machine the checkpoint key's folder, nor a writable view of
where signed rows' files live (smolbench.signing.volume_refusal). Each test's attack is written
beside it; each failed before volumes were checked (c266793)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from fakesmol import backend

import smolbench
from smolbench.backends import _bwrap
from smolbench.errors import SmolbenchError, SmolfileError
from smolbench.ledger import Ledger
from smolbench.smolfile import parse_smolfile
from smolbench.spec import MachineSpec, Volume
from smolbench.workbench import Workbench

HAVE_BWRAP = shutil.which("bwrap") is not None
KEY = "the folder of your checkpoint key"


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This user's state folder (their key's), in a folder of its own."""
    folder = tmp_path / "home" / ".local" / "state" / "smolbench"
    folder.mkdir(parents=True, mode=0o700)
    (folder / "inside").mkdir()
    monkeypatch.setenv("SMOLBENCH_STATE", str(folder))
    return folder


@pytest.mark.parametrize("which", ["is", "holds", "inside", "link"])
def test_a_volume_of_the_key_folder_is_refused(state: Path, tmp_path: Path, which: str) -> None:
    """Attack: a Smolfile (a copied project's, or the user's own `host = "~"`) mounts the key's
    folder, one above it or one in it (or a link to it): the machine reads checkpoint.key (or
    writes one of its choosing) and signs rows as this user, so a copied folder's smol row
    reaches smol's engine. Refused in one line, on the folder's real path."""
    (tmp_path / "proj").mkdir()
    host = {"is": str(state), "holds": str(tmp_path / "home"), "inside": str(state / "inside"),
            "link": "key-link"}[which]
    if which == "link":
        (tmp_path / "proj" / "key-link").symlink_to(state)
    text = f'[[volumes]]\nhost = "{host}"\nguest = "/data"\n'
    with pytest.raises(SmolfileError) as got:
        parse_smolfile(text, base_dir=str(tmp_path / "proj"))
    said = str(got.value)
    assert said.startswith("Smolfile line 2: volume 1 is refused: its host folder ") and KEY in said, said
    assert said.endswith("mount a folder that neither holds nor is in it (or set $SMOLBENCH_STATE to a folder "
                         "outside what you mount)"), said
    assert "\n" not in said
    parse_smolfile('[[volumes]]\nhost = "."\nguest = "/data"\n', base_dir=str(tmp_path / "proj"))  # the control


def test_a_writable_volume_over_the_ledger_folder_is_refused(state: Path, tmp_path: Path) -> None:
    """Attack: a writable volume holding the project's .smolbench/ (`host = "."`, readonly =
    false) lets a cell rewrite a signed checkpoint file in place after a restore hashed it (smol's
    engine reads it by name after the check), or the ledger under the kernel. Refused before
    anything comes up; read-only, a folder beside it, and one beside a ledger kept in the
    project's own folder (`ledger="ledger.db"`: it was refused as "inside" its folder) are fine."""
    proj = tmp_path / "proj"
    (proj / ".smolbench").mkdir(parents=True)
    (proj / "data").mkdir()
    for host, readonly, ledger, refused in ((proj, False, ".smolbench/ledger.db", True),
                                            (proj / ".smolbench", False, ".smolbench/ledger.db", True),
                                            (proj, True, ".smolbench/ledger.db", False),
                                            (proj / "data", False, ".smolbench/ledger.db", False),
                                            (proj / "data", False, "ledger.db", False),
                                            (proj, False, "ledger.db", True)):
        spec = MachineSpec(volumes=(Volume(host=str(host), guest="/work", readonly=readonly),))
        led = Ledger(proj / ledger)
        try:
            if not refused:
                Workbench(backend(), spec, led)
                continue
            with pytest.raises(SmolbenchError) as got:
                Workbench(backend(), spec, led)
            said = str(got.value)
            assert said.startswith(f"refusing the volume at /work: its host folder {host} is writable and is or holds "
                                   f"{(proj / ledger).parent}"), said
            assert said.endswith("make the volume readonly = true, mount a folder that doesn't hold it, or keep the "
                                 "ledger elsewhere (`--ledger PATH`)")
        finally:
            led.close()


def test_a_writable_volume_made_a_link_to_the_ledger_folder_is_refused_when_bound(state: Path, open_tmp: Path) -> None:
    """Attack (outside review): volumes `scratch` and `scratch/out`, both writable, pass the
    Workbench's check; a cell in the first machine replaces /scratch/out with a link to
    ../.smolbench, and the next machine (a branch, a restart) got the ledger's folder writable at
    /out. The sandbox and smol check every writable volume against this kernel's ledger and
    checkpoint folders where they bind it."""
    proj = open_tmp / "proj"
    (proj / "scratch" / "out").mkdir(parents=True)
    for folder in (proj, proj / "scratch", proj / "scratch" / "out"):  # (a root kernel's sandbox uid writes there)
        folder.chmod(0o777)
    spec = parse_smolfile('volumes = [{ host = "scratch", guest = "/scratch", readonly = false },'
                          ' { host = "scratch/out", guest = "/out", readonly = false }]\n', base_dir=str(proj))
    led = Ledger(proj / ".smolbench" / "ledger.db")
    (proj / ".smolbench").chmod(0o777)  # as a non-root kernel's is to its sandboxes (they run as its uid)
    try:
        Workbench(backend(), spec, led)
        _bwrap.plan(spec, "m1", "bwrap", None).close()  # the first machine: fine
        (proj / "scratch" / "out").rmdir()
        (proj / "scratch" / "out").symlink_to("../.smolbench")  # what its cell did
        refusal = f"^refusing the volume at /out: its host folder .* is writable and is or holds {proj / '.smolbench'}"
        with pytest.raises(SmolbenchError, match=refusal):
            _bwrap.plan(spec, "m2", "bwrap", None)
        with pytest.raises(SmolbenchError, match=refusal):
            backend().machine_config(spec, "m2")
    finally:
        led.close()


def test_a_python_installation_holding_the_key_folder_is_never_bound(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside review: a Python installed with --prefix=$HOME/.local is bound read-only into every
    sandbox, and that folder holds ~/.local/state/smolbench: as the user's own uid (a non-root
    kernel) a cell read the key there. Refused in one line naming $SMOLBENCH_STATE."""
    prefix = state.parent.parent  # ~/.local
    monkeypatch.setattr(_bwrap, "python_prefixes", lambda: [str(prefix)])
    with pytest.raises(SmolbenchError, match=f"^this Python's installation {prefix}, which sandboxes bind read-only, "
                                             f"holds {KEY} .*; set \\$SMOLBENCH_STATE to a folder outside {prefix}$"):
        _bwrap.plan(MachineSpec(), "m", "bwrap", None)


def test_no_home_and_a_relative_state_folder_are_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Outside review: with no $HOME and no passwd entry (a container's uid), every volume failed
    with a raw RuntimeError; a relative $SMOLBENCH_STATE moved the key's folder with the kernel's
    working folder."""
    from smolbench import signing

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("SMOLBENCH_STATE")
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    (tmp_path / "data").mkdir()
    parse_smolfile('[[volumes]]\nhost = "data"\nguest = "/data"\n', base_dir=str(tmp_path))  # no key, none exposed
    key, why = signing._key_or_why()
    assert key is None and why is not None and "set $SMOLBENCH_STATE to a folder of your own" in why
    monkeypatch.setenv("SMOLBENCH_STATE", "state")
    with pytest.raises(SmolbenchError, match=r"^\$SMOLBENCH_STATE is 'state', a relative path, .*: set it to an "
                                             r"absolute path$"):
        signing.state_dir()


def test_a_volume_made_a_link_to_the_key_folder_after_parsing_is_refused_when_bound(state: Path, tmp_path: Path) -> None:
    """Attack: the Smolfile's volume was a plain folder when parsed, and a machine with a writable
    volume above it (or anyone) made it a link to the key's folder since: the next machine (a
    branch, a restart) bound what the link reached. The sandbox checks what it binds."""
    (tmp_path / "data").mkdir()
    spec = parse_smolfile('[[volumes]]\nhost = "data"\nguest = "/data"\n', base_dir=str(tmp_path))
    (tmp_path / "data").rmdir()
    (tmp_path / "data").symlink_to(state)
    with pytest.raises(SmolbenchError, match=f"^refusing the volume at /data: its host folder {tmp_path / 'data'} is, "
                                             f"holds or is inside {KEY} \\({state}\\)"):
        _bwrap.plan(spec, "m", "bwrap", None)


def test_a_smol_machine_is_never_given_the_key_folder(state: Path, tmp_path: Path) -> None:
    """Attack: smol's engine (a host process of this user) mounts a volume by path for the microVM:
    a spec whose volume is the key's folder (not parsed from a Smolfile, or a link made since)
    handed the machine the key. Refused where the mounts are made."""
    spec = MachineSpec(volumes=(Volume(host=str(state), guest="/stolen", readonly=True),))
    with pytest.raises(SmolbenchError, match=f"^refusing the volume at /stolen: its host folder {state} is, holds "
                                             f"or is inside {KEY}"):
        backend().machine_config(spec, "m")


@pytest.mark.skipif(not HAVE_BWRAP or os.geteuid() == 0,
                    reason="bubblewrap is not installed, or this is root (its sandbox runs as another uid)")
def test_a_machine_never_reads_the_key(state: Path, tmp_path: Path) -> None:
    """The attack end to end, where a sandbox runs as the user's own uid (a non-root kernel): a
    cell read the key through a volume of its folder. Refused before a machine comes up."""
    from smolbench import signing

    secret = signing.key()
    assert secret is not None
    smolfile = tmp_path / "Smolfile"
    smolfile.write_text(f'[[volumes]]\nhost = "{state}"\nguest = "/stolen"\n')
    with pytest.raises(SmolbenchError, match=KEY):
        with smolbench.Session(smolfile=str(smolfile), backend="sandbox", ledger=str(tmp_path / "l" / "ledger.db"),
                               on_notice=lambda line: None) as s:
            out = s.run("print(open('/stolen/checkpoint.key', 'rb').read().hex())").stdout.strip()
            assert out != secret.hex(), "the machine read the checkpoint key"


def _rootfs(folder: Path) -> Path:
    (folder / "usr" / "bin").mkdir(parents=True, exist_ok=True)
    (folder / "usr" / "bin" / "python3").write_text("")
    return folder


@pytest.mark.parametrize("which", ["/", "holds", "link"])
def test_an_image_folder_holding_the_key_folder_is_refused(state: Path, tmp_path: Path, which: str) -> None:
    """Third audit: a Smolfile's ``image = "/"`` (someone else's Smolfile) gave a smol VM the
    host's whole root as its disk, the key with it, where the same folder as a read-only volume
    was refused. Refused in one line at parse, and where smol is handed the path."""
    from smolbench.backends import smol_image

    (tmp_path / "proj").mkdir()
    home = _rootfs(tmp_path / "home")
    image = {"/": "/", "holds": str(home), "link": "./root-link"}[which]
    if which == "link":
        (tmp_path / "proj" / "root-link").symlink_to(home)
    if which == "/" and not (Path("/usr/bin/python3")).exists():
        pytest.skip("this host's / has no usr/bin/python3 (the image check that comes first)")
    with pytest.raises(SmolfileError) as got:
        parse_smolfile(f'image = "{image}"\n', base_dir=str(tmp_path / "proj"))
    said = str(got.value)
    assert said.startswith("Smolfile line 1: 'image': refusing the image folder ") and KEY in said, said
    assert "\n" not in said
    with pytest.raises(SmolbenchError, match="refusing the image folder"):
        smol_image.smol_image(str(home))
    other = _rootfs(tmp_path / "elsewhere")
    assert parse_smolfile(f'image = "{other}"\n', base_dir=str(tmp_path / "proj")).image == str(other)  # the control


def test_the_sandbox_never_binds_an_image_folder_holding_the_key_folder(state: Path, tmp_path: Path) -> None:
    """The same at the sandbox's bind (its real path then: the Smolfile's folder may have become
    a link to one above the key since it was parsed)."""
    home = _rootfs(tmp_path / "home")
    with pytest.raises(SmolbenchError, match="refusing the image folder"):
        _bwrap.plan(MachineSpec(), "m", "bwrap", home).close()
    _bwrap.plan(MachineSpec(), "m", "bwrap", _rootfs(tmp_path / "elsewhere")).close()
