"""The smol backend with local images, slow boots and checkpoints smol refuses, against the
fake engine of ``fakesmol.py`` (which refuses and times out the way the real SDK does);
and the boot probe's cheap checks and configurable limit."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import smol
from fakesmol import FakeHost, backend, fake_host, run
from smol import MachineConfig

from smolbench.backends import probe as probemod
from smolbench.backends import smol_state
from smolbench.backends.base import CellRequest, CellResult, MachineRef
from smolbench.backends.smol import DEFAULT_IMAGE, SmolBackend
from smolbench.errors import SmolbenchError
from smolbench.spec import MachineSpec


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHost]:
    yield from fake_host(monkeypatch)


async def cell(b: SmolBackend, ref: MachineRef, code: str) -> CellResult:
    return await b.exec_cell(ref, CellRequest(code=code), lambda event: None)


def plain(result: CellResult) -> str:
    assert result.status == "ok", result.error
    assert result.result is not None
    return str(result.result["text/plain"])


def rootfs(path: Path) -> Path:
    (path / "usr" / "bin").mkdir(parents=True)
    (path / "usr" / "bin" / "python3").write_text("")
    return path


# -- images --------------------------------------------------------------------------------


def test_local_images_boot_as_smol_takes_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMOLBENCH_CACHE", str(tmp_path / "cache"))
    b = backend()
    directory = rootfs(tmp_path / "rootfs")
    archive = tmp_path / "img.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(directory, arcname=".")
    built = rootfs(tmp_path / "cache" / "images" / "debian-bookworm")  # `smolbench image build`
    assert b.machine_config(MachineSpec(image=str(directory)), "a").image == str(directory)
    assert b.machine_config(MachineSpec(image=str(archive)), "a").image == str(archive)
    assert b.machine_config(MachineSpec(image="debian:bookworm"), "a").image == str(built)
    assert b.machine_config(MachineSpec(image="python:3.11"), "a").image == "python:3.11"
    assert b.machine_config(MachineSpec(), "a").image == DEFAULT_IMAGE


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: p / "nope", "image path .* does not exist: point image at a rootfs directory"),
        (lambda p: p, "has no usr/bin/python3: install python3 in it"),
        (lambda p: (p / "x.txt").write_text("hi") and p / "x.txt", "neither a rootfs directory nor"),
    ],
)
def test_bad_local_images_get_one_line(tmp_path: Path, make: Any, says: str) -> None:
    with pytest.raises(SmolbenchError, match=says) as info:
        backend().machine_config(MachineSpec(image=str(make(tmp_path))), "a")
    assert "\n" not in str(info.value)


def test_cloud_machines_cant_boot_local_images(tmp_path: Path) -> None:
    with pytest.raises(SmolbenchError, match="smol cloud machines can't boot"):
        SmolBackend(target="cloud").machine_config(MachineSpec(image=str(rootfs(tmp_path))), "a")


def test_boot_timeout_reaches_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend().machine_config(MachineSpec(), "a").ready_timeout_seconds == 120.0
    monkeypatch.setenv("SMOLBENCH_SMOL_BOOT_TIMEOUT", "900")
    assert backend().machine_config(MachineSpec(), "a").ready_timeout_seconds == 900.0
    monkeypatch.setenv("SMOLBENCH_SMOL_BOOT_TIMEOUT", "soon")
    with pytest.raises(SmolbenchError, match="SMOLBENCH_SMOL_BOOT_TIMEOUT='soon' is not a number"):
        backend().machine_config(MachineSpec(), "a")


# -- slow boots ----------------------------------------------------------------------------


def test_a_machine_too_slow_for_smols_fixed_agent_wait_gets_the_fix(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start_forkable waits 180 s whatever ready_timeout_seconds says: the line names the fix."""
    monkeypatch.setenv("SMOLBENCH_SMOL_BOOT_TIMEOUT", "900")
    host.ready_seconds = lambda config: config.resources.memory_mb / 4  # 4 GiB: 1024 s
    with pytest.raises(SmolbenchError) as info:
        run(backend().create(MachineSpec(memory=4096), "root"))
    text = str(info.value)
    assert text.startswith("the machine was not ready within smol's fixed 180 s wait")
    assert "less memory" in text and "smaller image" in text and "\n" not in text
    assert host.vms == []  # nothing was made


def test_a_plain_machine_waits_as_long_as_it_is_told(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    host.ready_seconds = lambda config: 200.0
    with pytest.raises(SmolbenchError, match="did not boot within 120 s: .*SMOLBENCH_SMOL_BOOT_TIMEOUT"):
        run(backend().create(MachineSpec(branch=False), "root"))
    monkeypatch.setenv("SMOLBENCH_SMOL_BOOT_TIMEOUT", "300")
    b = backend()

    async def main() -> str:
        ref = await b.create(MachineSpec(branch=False), "root")
        try:
            return plain(await cell(b, ref, "6 * 7"))
        finally:
            await b.close()

    assert run(main()) == "42"


# -- checkpoints of local-image machines -----------------------------------------------------


def test_checkpoint_of_a_local_image_machine_falls_back_to_its_state(
    host: FakeHost, tmp_path: Path
) -> None:
    """smol refuses to capture host-backed layers; the fallback says so and restores the state."""
    b = backend()
    spec = MachineSpec(image=str(rootfs(tmp_path / "img")))
    path = str(tmp_path / "ckpt" / "a.smolcheckpoint")

    async def main() -> tuple[Any, str, str, list[str]]:
        root = await b.create(spec, "root")
        try:
            await cell(b, root, "x = 5\nopen('notes.txt', 'w').write('kept')")
            info = await b.checkpoint(root, path)
            await cell(b, root, "x = 6")
            back = await b.restore(path, "back", spec)
            x = plain(await cell(b, back, "x"))
            notes = plain(await cell(b, back, "open('notes.txt').read()"))
            return info, x, notes, back.info["restore_warnings"]
        finally:
            await b.close()

    info, x, notes, warnings = run(main())
    assert (x, notes) == ("5", "'kept'")
    assert info.warnings == [smol_state.STATE_ONLY] and warnings == [smol_state.STATE_ONLY]
    assert "workspace and namespace only" in smol_state.STATE_ONLY
    assert "\n" not in smol_state.STATE_ONLY and "Smolfile" not in smol_state.STATE_ONLY
    host.vms[0].machine.checkpoint.assert_called_once()  # the real capture was tried first
    with tarfile.open(path) as tar:
        assert sorted(tar.getnames()) == ["namespace.pkl", "smolbench-state.json", "workspace.tar"]
        marker = tar.extractfile("smolbench-state.json")
        assert marker is not None and json.load(marker)["kind"] == "smolbench-smol-state"
    assert host.cls.restore_checkpoint.call_count == 0


def test_a_damaged_state_checkpoint_is_one_line(host: FakeHost, tmp_path: Path) -> None:
    path = tmp_path / "bad.smolcheckpoint"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(rootfs(tmp_path / "r"), arcname="r")
    with pytest.raises(SmolbenchError, match="is not a smol checkpoint"):
        run(backend().restore(str(path), "x", MachineSpec()))
    path.write_bytes(b"\x1f\x8b" + b"garbage")
    with pytest.raises(SmolbenchError, match="is corrupt or truncated"):
        run(backend().restore(str(path), "x", MachineSpec()))
    assert host.vms == []


# -- the probe -------------------------------------------------------------------------------


def test_a_kvm_pvm_host_answers_at_once_without_booting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SMOLBENCH_SMOL_PROBE", raising=False)
    monkeypatch.setattr(probemod, "KVM_PVM", str(tmp_path))  # present, as on this host
    monkeypatch.setattr(probemod, "_boot", lambda timeout: pytest.fail("booted"))
    ok, reason = probemod.probe_smol(use_cache=False)
    assert not ok and reason.startswith("/dev/kvm here is kvm-pvm")
    assert "--backend sandbox" in reason


def test_without_kvm_pvm_the_probe_boots_with_the_configured_limit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Where microVMs may boot (the emulated lane), auto must still try them."""
    monkeypatch.delenv("SMOLBENCH_SMOL_PROBE", raising=False)
    monkeypatch.setenv("SMOLBENCH_CACHE", str(tmp_path))
    monkeypatch.setenv("SMOLBENCH_SMOL_PROBE_TIMEOUT", "900")
    monkeypatch.setattr(probemod, "KVM_PVM", str(tmp_path / "absent"))
    monkeypatch.setattr(smol, "local_availability", lambda: (True, None, None))
    boots: list[float] = []

    def boot(timeout: float) -> tuple[bool, str, float]:
        boots.append(timeout)
        return True, "booted", 1.0

    monkeypatch.setattr(probemod, "_boot", boot)
    assert probemod.probe_smol(use_cache=False) == (True, "booted")
    assert boots == [900.0]
    monkeypatch.setattr(probemod, "KVM_PVM", str(tmp_path))
    monkeypatch.setenv("SMOLBENCH_SMOL_PROBE", "force")
    probemod.probe_smol(use_cache=False, timeout=5)
    assert boots == [900.0, 5]


def test_the_verdict_says_what_it_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(argv: list[str], timeout: float) -> tuple[int | None, str]:
        if "-c" in argv and "Machine.create" in argv[argv.index("-c") + 1]:
            return 0, 'SMOLBENCH_PROBE {"ok": true, "seconds": 182.1}\n'
        return 0, ""

    monkeypatch.setattr(probemod, "_run_bounded", fake_run)
    ok, reason, _ = probemod._boot(900)
    assert ok and reason == (
        "a 256 MiB test microVM booted, ran `true` and was deleted in 182.1 s (probe limit 900 s)"
    )
    monkeypatch.setattr(probemod, "_run_bounded", lambda argv, timeout: (None, ""))
    ok, reason, _ = probemod._boot(45)
    assert not ok and reason.startswith("a 256 MiB test microVM did not boot within the probe's 45 s")
    assert "SMOLBENCH_SMOL_PROBE_TIMEOUT=900" in reason


def test_the_fake_checkpoint_refusal_is_the_real_text() -> None:
    """Keeps the fallback's trigger honest: the phrase smol 1.32.2 was seen to use."""
    config = MachineConfig(name="x", image="/srv/pyimg")
    assert config.image is not None and smol_state.STATE_ONLY
    from fakesmol import HOST_BACKED

    from smolbench.backends.smol_errors import HOST_BACKED as TRIGGER

    assert TRIGGER in HOST_BACKED.lower()


def test_a_branch_that_never_answers_its_seed_is_an_infra_error(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """smol kills a control exec at its timeout and returns no output: that is a machine
    that didn't answer (retryable), not a cell that died."""
    from fakesmol import FakeVM
    from smol import ExecOptions, ExecStream

    from smolbench.backends import smol as smolmod
    from smolbench.errors import InfraError

    real_stream = FakeVM.exec_stream

    def silent_seed(self: FakeVM, command: list[str], opts: ExecOptions | None = None) -> ExecStream:
        request = Path(self.path(command[-1]))  # a control request reaches the relay as a file
        if command[3:4] == [smolmod.CLIENT] and '"seed"' in request.read_text():
            request.unlink()
            return ExecStream(iter([{"kind": "exit", "exit_code": 137}]), lambda: None)
        return real_stream(self, command, opts)

    monkeypatch.setattr(FakeVM, "exec_stream", silent_seed)
    b = backend()

    async def main() -> None:
        root = await b.create(MachineSpec(), "root")
        try:
            with pytest.raises(InfraError, match="gave no answer to its seed request within 120 s"):
                await b.branch(root, ["root.0"], [1])
            assert [r.name for r in b.list()] == ["root"]  # the silent branch was deleted
        finally:
            await b.close()

    run(main())
