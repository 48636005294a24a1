"""The smol backend on REAL microVMs: runs only where ``probe_smol()`` boots one.

Elsewhere the whole module is skipped with the probe's one-line reason (shown
by ``pytest -rs``). The probe's verdict is cached in the smolbench cache
directory, so only the first run on a host pays for a test boot (6-30 s).
``SMOLBENCH_TEST_SMOL_IMAGE`` picks the image (default: the backend's).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from smolbench.backends.probe import probe_smol

OK, REASON = probe_smol(use_cache=True)
if not OK:
    print(f"\ntests/test_smol_real_vm.py: skipped, {REASON}", file=sys.stderr)
    pytest.skip(f"no smol microVMs on this host: {REASON}", allow_module_level=True)

from smol import Machine  # noqa: E402

from smolbench.backends.base import CellRequest, CellResult, MachineRef  # noqa: E402
from smolbench.backends.smol import DEFAULT_IMAGE, SmolBackend  # noqa: E402
from smolbench.spec import MachineSpec  # noqa: E402

T = TypeVar("T")
# Network on, so a first use can pull the image (smol pulls it from inside the machine).
SPEC = MachineSpec(image=os.environ.get("SMOLBENCH_TEST_SMOL_IMAGE", DEFAULT_IMAGE), net=True)


class Session:
    """One backend, one event loop and one warm root machine shared by the module's tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.backend = SmolBackend(probe=False)
        self.root: MachineRef | None = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        """Run one coroutine on the session's loop."""
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def cell(self, ref: MachineRef, code: str) -> CellResult:
        """Run one cell and return its result."""
        return self.run(self.backend.exec_cell(ref, CellRequest(code=code), lambda event: None))

    def ours(self) -> list[Any]:
        """Machines smol still lists with this session's labels."""
        return Machine.list(self.backend.conn, self.backend.labels)


@pytest.fixture(scope="module")
def vm() -> Iterator[Session]:
    """A session with a booted root machine; every machine is deleted afterwards."""
    session = Session()
    try:
        session.root = session.run(session.backend.create(SPEC, "root"))
        yield session
    finally:
        try:
            session.run(session.backend.close())
            assert session.ours() == []
        finally:
            session.loop.close()


def plain(result: CellResult) -> str:
    assert result.status == "ok", result.error
    assert result.result is not None
    return str(result.result["text/plain"])


def test_state_persists_across_cells(vm: Session) -> None:
    assert vm.root is not None
    first = vm.cell(vm.root, "import platform\nx = 40\nprint('kernel', platform.release())")
    assert first.status == "ok" and first.stdout.startswith("kernel ")
    assert plain(vm.cell(vm.root, "x + 2")) == "42"


def test_branches_get_their_seeds_and_the_parents_state(vm: Session) -> None:
    assert vm.root is not None
    vm.cell(vm.root, "base = 7")
    kids = vm.run(vm.backend.branch(vm.root, ["root.0", "root.1"], [11, 22]))
    try:
        seen = [
            plain(vm.cell(k, "import smolbench_guest\n(SEED, base, smolbench_guest.node)"))
            for k in kids
        ]
        assert seen == ["(11, 7, 'root.0')", "(22, 7, 'root.1')"]
        vm.cell(kids[0], "base = 100")
        assert plain(vm.cell(vm.root, "base")) == "7"
    finally:
        for kid in kids:
            vm.run(vm.backend.delete(kid))
    names = {m.name for m in vm.ours()}
    assert not any(k.info["machine"] in names for k in kids)


def test_checkpoint_and_restore(vm: Session, tmp_path: Path) -> None:
    assert vm.root is not None
    vm.cell(vm.root, "saved = 'before'")
    info = vm.run(vm.backend.checkpoint(vm.root, str(tmp_path / "root.smolcheckpoint")))
    assert info.backend == "smol" and info.size > 0 and os.path.exists(info.path)
    vm.cell(vm.root, "saved = 'after'")
    back = vm.run(vm.backend.restore(info.path, "back", SPEC))
    try:
        assert plain(vm.cell(back, "saved")) == "'before'"
    finally:
        vm.run(vm.backend.delete(back))


def test_everything_is_deleted(vm: Session) -> None:
    vm.run(vm.backend.close())
    assert vm.backend.list() == []
    assert vm.ours() == []
